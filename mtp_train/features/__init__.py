"""Feature cache: the target's hidden states over the prepared data (format, precompute driver, reader, verify)."""
