"""Ray orchestration: backend actors, driver-side handles, actor-to-actor refit."""
