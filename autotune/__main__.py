from autotune.drivers.cli import run

run()
