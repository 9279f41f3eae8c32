"""The `distgrad demo` command's pieces (private)."""
