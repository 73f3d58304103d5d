"""Which configurations to try: the search space (space), the controller that walks the memory-tuning
decision graph and explores beyond it, each trial's record (records), and the Optuna study (store)."""
