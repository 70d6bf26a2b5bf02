"""tune: fine-tunes the selector on retrieved shortlists (optional dependencies; never imported by the services)."""
