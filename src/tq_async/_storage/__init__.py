"""Storage units: cell stores behind a thin ROUTER server."""
