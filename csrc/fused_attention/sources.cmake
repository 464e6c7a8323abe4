# fused_attention: cuDNN SDPA through the cuDNN frontend graph API, in its own extension module
# te_ops._native_cudnn (so a missing cuDNN disables only this op).
#
# Needs:
#   cudnn.h + libcudnn.so(.9)  -- cuDNN 9: the CUDA toolkit, site-packages nvidia/cudnn/{include,lib}
#                                 (the nvidia-cudnn-cu12/cu13 wheel JAX uses), or -DTE_CUDNN_ROOT=<dir
#                                 with include/ and lib/>.
#   cudnn_frontend.h           -- header-only cuDNN frontend: -DTE_CUDNN_FRONTEND_INCLUDE=<dir>, the
#                                 installed nvidia-cudnn-frontend wheel (it installs include/ at the top of
#                                 site-packages), or a wheel file in <repo>/.whl/ which is unpacked into the
#                                 build tree.

set(TE_CUDNN_ROOT "" CACHE PATH "cuDNN root (include/cudnn.h, lib/libcudnn.so*)")
set(TE_CUDNN_FRONTEND_INCLUDE "" CACHE PATH "Directory holding cudnn_frontend.h")

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import sysconfig; print(sysconfig.get_paths()['purelib']); print(sysconfig.get_paths()['platlib'])"
  OUTPUT_VARIABLE _te_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
string(REPLACE "\n" ";" _te_site "${_te_site}")
# Where the installed wheels put their files (works for --target/--user installs too).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.metadata as m, os\nfor d in ('nvidia-cudnn-frontend', 'nvidia-cudnn-cu13', 'nvidia-cudnn-cu12'):\n    try:\n        fs = m.files(d) or []\n    except Exception:\n        continue\n    for f in fs:\n        s = str(f)\n        if s.endswith(('include/cudnn_frontend.h', 'include/cudnn.h')) or '/lib/libcudnn.so' in s:\n            print(os.path.dirname(str(f.locate())))"
  OUTPUT_VARIABLE _te_dist_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
string(REPLACE "\n" ";" _te_dist_dirs "${_te_dist_dirs}")

set(_te_cudnn_inc_hints "")
set(_te_cudnn_lib_hints "")
if(TE_CUDNN_ROOT)
  list(APPEND _te_cudnn_inc_hints "${TE_CUDNN_ROOT}/include")
  list(APPEND _te_cudnn_lib_hints "${TE_CUDNN_ROOT}/lib" "${TE_CUDNN_ROOT}/lib64")
endif()
foreach(_s ${_te_site})
  list(APPEND _te_cudnn_inc_hints "${_s}/nvidia/cudnn/include" "${_s}/nvidia/cu13/include" "${_s}/nvidia/cu12/include")
  list(APPEND _te_cudnn_lib_hints "${_s}/nvidia/cudnn/lib" "${_s}/nvidia/cu13/lib" "${_s}/nvidia/cu12/lib")
endforeach()
list(APPEND _te_cudnn_inc_hints ${_te_dist_dirs} ${CUDAToolkit_INCLUDE_DIRS})
list(APPEND _te_cudnn_lib_hints ${_te_dist_dirs} ${CUDAToolkit_LIBRARY_DIR})

find_path(TE_CUDNN_INCLUDE_DIR cudnn.h HINTS ${_te_cudnn_inc_hints} NO_CACHE)
find_library(TE_CUDNN_LIBRARY NAMES libcudnn.so.9 cudnn NAMES_PER_DIR HINTS ${_te_cudnn_lib_hints} NO_CACHE)
# The frontend (1.2x+) includes nvrtc.h and, without dynamic loading, calls NVRTC and the CUDA driver
# directly (its optional runtime-compiled engines): the CUDA toolkit, or the nvidia-cuda-nvrtc wheel.
set(TE_NVRTC_ROOT "" CACHE PATH "Directory with include/nvrtc.h and lib/libnvrtc.so* (default: CUDA toolkit / wheel)")
set(_te_nvrtc_inc_hints ${CUDAToolkit_INCLUDE_DIRS})
set(_te_nvrtc_lib_hints ${CUDAToolkit_LIBRARY_DIR})
if(TE_NVRTC_ROOT)
  list(PREPEND _te_nvrtc_inc_hints "${TE_NVRTC_ROOT}/include")
  list(PREPEND _te_nvrtc_lib_hints "${TE_NVRTC_ROOT}/lib" "${TE_NVRTC_ROOT}/lib64")
endif()
foreach(_s ${_te_site})
  list(APPEND _te_nvrtc_inc_hints "${_s}/nvidia/cu13/include" "${_s}/nvidia/cuda_nvrtc/include")
  list(APPEND _te_nvrtc_lib_hints "${_s}/nvidia/cu13/lib" "${_s}/nvidia/cuda_nvrtc/lib")
endforeach()
find_path(TE_NVRTC_INCLUDE_DIR nvrtc.h HINTS ${_te_nvrtc_inc_hints} NO_CACHE)
find_library(TE_NVRTC_LIBRARY NAMES nvrtc libnvrtc.so.13 libnvrtc.so.12 NAMES_PER_DIR HINTS ${_te_nvrtc_lib_hints} NO_CACHE)

# cuDNN frontend headers: explicit dir, installed wheel, or a wheel file in .whl/ unpacked here.
set(_te_fe_hints "")
if(TE_CUDNN_FRONTEND_INCLUDE)
  list(APPEND _te_fe_hints "${TE_CUDNN_FRONTEND_INCLUDE}")
endif()
foreach(_s ${_te_site})
  list(APPEND _te_fe_hints "${_s}/include" "${_s}/cudnn_frontend/include")
endforeach()
list(APPEND _te_fe_hints ${_te_dist_dirs})
find_path(TE_CUDNN_FRONTEND_DIR cudnn_frontend.h HINTS ${_te_fe_hints} NO_CACHE NO_DEFAULT_PATH)
if(NOT TE_CUDNN_FRONTEND_DIR)
  file(GLOB _te_fe_wheels "${CMAKE_CURRENT_SOURCE_DIR}/.whl/nvidia_cudnn_frontend-*.whl")
  if(_te_fe_wheels)
    list(SORT _te_fe_wheels)
    list(GET _te_fe_wheels -1 _te_fe_wheel)
    set(_te_fe_unpack "${CMAKE_CURRENT_BINARY_DIR}/cudnn_frontend_wheel")
    if(NOT EXISTS "${_te_fe_unpack}/include/cudnn_frontend.h")
      file(MAKE_DIRECTORY "${_te_fe_unpack}")
      execute_process(COMMAND "${CMAKE_COMMAND}" -E tar xf "${_te_fe_wheel}" -- include
                      WORKING_DIRECTORY "${_te_fe_unpack}" RESULT_VARIABLE _te_unzip_rc OUTPUT_QUIET ERROR_QUIET)
    endif()
    if(EXISTS "${_te_fe_unpack}/include/cudnn_frontend.h")
      set(TE_CUDNN_FRONTEND_DIR "${_te_fe_unpack}/include")
      message(STATUS "te_ops: cuDNN frontend headers unpacked from ${_te_fe_wheel}")
    endif()
  endif()
endif()

set(_te_missing "")
if(NOT TE_CUDNN_INCLUDE_DIR)
  list(APPEND _te_missing "cudnn.h (set TE_CUDNN_ROOT or install nvidia-cudnn-cu13)")
endif()
if(NOT TE_CUDNN_LIBRARY)
  list(APPEND _te_missing "libcudnn.so (set TE_CUDNN_ROOT or install nvidia-cudnn-cu13)")
endif()
if(NOT TE_NVRTC_INCLUDE_DIR OR NOT TE_NVRTC_LIBRARY)
  list(APPEND _te_missing "nvrtc.h/libnvrtc (needed by the cuDNN frontend; set TE_NVRTC_ROOT or install nvidia-cuda-nvrtc)")
endif()
if(NOT TE_CUDNN_FRONTEND_DIR)
  list(APPEND _te_missing "cudnn_frontend.h (set TE_CUDNN_FRONTEND_INCLUDE, install nvidia-cudnn-frontend, or put its wheel in .whl/)")
endif()

if(_te_missing)
  string(REPLACE ";" ", " _te_missing "${_te_missing}")
  message(STATUS "te_ops: fused_attention native skipped: missing ${_te_missing}")
else()
  get_filename_component(_te_cudnn_libdir "${TE_CUDNN_LIBRARY}" DIRECTORY)
  get_filename_component(_te_nvrtc_libdir "${TE_NVRTC_LIBRARY}" DIRECTORY)
  # The frontend calls a few CUDA driver functions directly (libcuda.so.1, loaded by JAX anyway).
  set(_te_driver "")
  if(TARGET CUDA::cuda_driver)
    set(_te_driver CUDA::cuda_driver)
  else()
    message(STATUS "te_ops: fused_attention: CUDA::cuda_driver not found; libcuda symbols resolve at load time")
  endif()
  message(STATUS "te_ops: fused_attention on cuDNN: ${TE_CUDNN_INCLUDE_DIR}/cudnn.h, ${TE_CUDNN_LIBRARY}, "
                 "frontend ${TE_CUDNN_FRONTEND_DIR}")
  te_add_native_module(_native_cudnn
    SOURCES "${CMAKE_CURRENT_LIST_DIR}/fused_attention_graphs.cc" "${CMAKE_CURRENT_LIST_DIR}/fused_attention_ffi.cc"
    LIBS "${TE_CUDNN_LIBRARY}" "${TE_NVRTC_LIBRARY}" ${_te_driver}
    INCLUDES "${TE_CUDNN_INCLUDE_DIR}" "${TE_CUDNN_FRONTEND_DIR}" "${TE_NVRTC_INCLUDE_DIR}"
    OPS fused_attention)
  # The frontend bundles nlohmann/json for (de)serialisation, which we do not use.
  target_compile_definitions(_native_cudnn PRIVATE CUDNN_FRONTEND_SKIP_JSON_LIB=1)
  # Load the same libcudnn.so.9 that JAX's CUDA plugin uses (site-packages nvidia/cudnn/lib).
  set_target_properties(_native_cudnn PROPERTIES BUILD_RPATH "${_te_cudnn_libdir};${_te_nvrtc_libdir}"
                                                 INSTALL_RPATH "${_te_cudnn_libdir};${_te_nvrtc_libdir};$ORIGIN/../nvidia/cudnn/lib;$ORIGIN/../nvidia/cu13/lib"
                                                 SKIP_BUILD_RPATH FALSE)
endif()
