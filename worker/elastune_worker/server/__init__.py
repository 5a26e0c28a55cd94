"""The worker process: HTTP server (Knative container contract) and the job agent."""
