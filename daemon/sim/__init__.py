"""The cluster simulator: our scheduler and prefix cache with the forward replaced by a measured cost table."""
