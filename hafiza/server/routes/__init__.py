"""HTTP routes: one module per API, plus the shared health, models and metrics endpoints."""
