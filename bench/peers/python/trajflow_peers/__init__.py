"""In-memory peers of trajflow for `trajflow bench peers`."""
