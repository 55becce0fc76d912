"""Where figures come from (provenance) and the README's results block generated from result files."""
