"""kvchat's own CPU kernels (C++ sources here), compiled once per machine by `build`."""
