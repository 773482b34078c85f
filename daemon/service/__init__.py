"""The daemon as a service: command line, settings, logging, systemd, the serve loop."""
