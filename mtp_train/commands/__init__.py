"""One module per subcommand: parse, call the library, print. `mtp_train.cli` registers them."""
