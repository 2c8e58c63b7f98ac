"""Pallas kernels, each beside its pure-jnp reference, and the backend choice between them."""
