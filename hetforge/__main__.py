from hetforge.cli import run

run()
