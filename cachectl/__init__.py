"""Node-local runtime weight cache: store library, CLI and per-node daemon."""
