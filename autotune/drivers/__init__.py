"""The doors and the commands: the CLI, `autotune.tune` (api), and the commands that call it many times
(plan, sweep, regress, seqlen, calibrate) or fit and write its constants (costmodel_fit, constants)."""
