"""Where pages live: the device and host stores and the moves between them, the host
tier's index, and the disk tier (its files, index and background writer)."""
