"""Where the installed C++ package lives, for CMake's ``find_package(causal_attention)``.

The wheel holds the engine's library, its public headers and a CMake package config::

    causal_attention/libcausal_attention.so
    causal_attention/include/causal_attention/{attention,module}.h
    causal_attention/share/cmake/causal_attention/causal_attentionConfig.cmake

A downstream CMake project finds it like torch's, with both prefixes (the config finds torch with
``find_dependency(Torch)``)::

    cmake -DCMAKE_PREFIX_PATH="$(python -c 'import causal_attention, torch;
        print(causal_attention.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path)')" ...
"""

from __future__ import annotations

from pathlib import Path

#: The directory to add to CMAKE_PREFIX_PATH (like ``torch.utils.cmake_prefix_path``).
cmake_prefix_path: str = str(Path(__file__).resolve().parent / "share" / "cmake")
