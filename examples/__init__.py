"""Examples shipped with the package as `rlhf.examples` (`builtin:<path>` in `env.path`)."""
