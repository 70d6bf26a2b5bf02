"""Build tools that make the served models' files (`make model`, the images); the services never import them."""
