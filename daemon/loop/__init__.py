"""The engine loop: requests, scheduler, 3-stage overlap pipeline, sampling."""
