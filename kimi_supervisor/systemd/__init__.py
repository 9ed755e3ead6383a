"""systemd: sd_notify and the watchdog, the unit install-unit writes, what systemctl show says of it."""
