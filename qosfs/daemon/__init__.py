"""The daemon: the command line, the mount's lifecycle (descriptors, privileges, the
nursery of servers, clean unmount), logging, systemd notification, FUSE connection
tuning."""
