"""The `minfer` command line (installed as the `minfer_cli` package): parse, call minfer, print."""
