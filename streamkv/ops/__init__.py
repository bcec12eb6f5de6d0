"""Native CPU ops (C++ / OpenMP through ``torch.utils.cpp_extension``), built once and loaded lazily.

See :mod:`streamkv.ops.cpu_ops`. Nothing here is imported by the model or the
engine unless the ``cpu`` attention backend is asked for (or ``auto`` picks it).
"""
