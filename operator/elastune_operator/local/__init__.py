"""The embedded local default: everything on one machine, no cluster, no GPU (`elastune run`)."""
