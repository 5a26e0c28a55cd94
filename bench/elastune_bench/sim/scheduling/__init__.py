"""The scheduling simulator: discrete-event GPU pools driving the operator's pure policies
(``elastune_operator.scheduling``), the paper's workloads and figures, the profile fit, the mixed
tuning + inference workload."""
