"""The daemon as a service: the command line (cli, flags, generate, config check), settings,
logging, systemd notify, the serve loop, the admin client and the in-process server."""
