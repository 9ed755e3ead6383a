"""Safe files for a root process: atomic writes, trusted directories, reading what others may have written."""
