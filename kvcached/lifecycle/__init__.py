"""The process's life: building the daemon from its parts, starting and stopping them
(``daemon``), what is opened before serving (``opening``), the host facilities it claims
(``process``: malloc, sockets; ``systemd``: sd_notify, the fd store), and upgrades in place
(``handover``: the protocol; ``succession``: both sides of it) (docs/operations.md)."""
