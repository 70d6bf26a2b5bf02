"""The client side of tooltrie: the Python client for orchestrators (`client`) and the `tooltrie` command (`cli`)."""
