"""Native CPU ops (C++ / OpenMP through ``torch.utils.cpp_extension``), built once and loaded lazily.

See :mod:`streamkv.ops.cpu_ops`. The extensions are built and loaded only when
the ``cpu`` attention backend is asked for (or ``auto`` picks it); the pure
Python helpers here (``host_malloc``, ``huge_pages``) import no extension.
"""
