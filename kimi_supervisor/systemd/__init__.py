"""systemd: sd_notify and the watchdog, the installed unit."""
