"""`python -m minfer ...` runs the command line."""
from minfer_cli.main import main

if __name__ == "__main__":
    main()
