"""Multi-turn environments: the interface (`base`), the agent loop (`loop`), trajectory rows (`rows`) and adapters."""
