"""Where a run keeps its files and reads its flags from (locations, the TOML config file); torch-free."""
