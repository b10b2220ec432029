"""Framework-neutral pieces shared by the torch and tensorflow adapters."""
