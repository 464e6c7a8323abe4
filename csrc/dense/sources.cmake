# dense needs cuBLASLt, so it builds its own extension module te_ops._native_cublaslt (a missing
# library disables only dense's native path). Header and library are searched in, in order:
#   TE_CUBLAS_ROOT (cache variable; a folder holding include/cublasLt.h and lib/libcublasLt.so*,
#     e.g. an unpacked nvidia-cublas wheel's nvidia/cu13),
#   the CUDA toolkit (CUDAToolkit_INCLUDE_DIRS, CUDA::cublasLt),
#   Python site-packages: nvidia/cublas and nvidia/cu13 (pip wheels).
set(TE_CUBLAS_ROOT "" CACHE PATH "Folder with include/cublasLt.h and lib/libcublasLt.so* (optional)")

set(_te_cublas_site "")
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import site, sys; print(';'.join(site.getsitepackages() + [site.getusersitepackages()]))"
  OUTPUT_VARIABLE _te_site_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
foreach(_sp ${_te_site_dirs})
  list(APPEND _te_cublas_site "${_sp}/nvidia/cublas" "${_sp}/nvidia/cu13" "${_sp}/nvidia/cu12")
endforeach()

set(_te_cublas_roots "")
if(TE_CUBLAS_ROOT)
  list(APPEND _te_cublas_roots "${TE_CUBLAS_ROOT}")
endif()
set(_te_inc_hints "")
foreach(_r ${_te_cublas_roots})
  list(APPEND _te_inc_hints "${_r}/include")
endforeach()
list(APPEND _te_inc_hints ${CUDAToolkit_INCLUDE_DIRS})
foreach(_r ${_te_cublas_site})
  list(APPEND _te_inc_hints "${_r}/include")
endforeach()

unset(TE_CUBLASLT_INCLUDE_DIR CACHE)
find_path(TE_CUBLASLT_INCLUDE_DIR cublasLt.h HINTS ${_te_inc_hints} NO_DEFAULT_PATH)

set(_te_cublaslt_lib "")
set(_te_cublaslt_libdir "")
if(TE_CUBLASLT_INCLUDE_DIR)
  get_filename_component(_te_cublas_base "${TE_CUBLASLT_INCLUDE_DIR}" DIRECTORY)
  # Prefer the library next to the header we compile against (wheel or TE_CUBLAS_ROOT), then the toolkit.
  unset(TE_CUBLASLT_LIBRARY CACHE)
  find_library(TE_CUBLASLT_LIBRARY
               NAMES cublasLt libcublasLt.so.13 libcublasLt.so.12
               HINTS "${_te_cublas_base}/lib" "${_te_cublas_base}/lib64"
               NO_DEFAULT_PATH)
  if(TE_CUBLASLT_LIBRARY)
    set(_te_cublaslt_lib "${TE_CUBLASLT_LIBRARY}")
    get_filename_component(_te_cublaslt_libdir "${TE_CUBLASLT_LIBRARY}" DIRECTORY)
  elseif(TARGET CUDA::cublasLt)
    set(_te_cublaslt_lib CUDA::cublasLt)
    get_target_property(_te_loc CUDA::cublasLt IMPORTED_LOCATION)
    if(_te_loc)
      get_filename_component(_te_cublaslt_libdir "${_te_loc}" DIRECTORY)
    endif()
  endif()
endif()

if(TE_CUBLASLT_INCLUDE_DIR AND _te_cublaslt_lib)
  file(GLOB _te_dense_sources "${CMAKE_CURRENT_SOURCE_DIR}/csrc/dense/*.cc"
                              "${CMAKE_CURRENT_SOURCE_DIR}/csrc/dense/*.cu")
  te_add_native_module(_native_cublaslt
                       SOURCES ${_te_dense_sources}
                       LIBS ${_te_cublaslt_lib}
                       INCLUDES "${TE_CUBLASLT_INCLUDE_DIR}"
                       OPS dense)
  # Find libcublasLt at import time: next to the library we linked (toolkit or wheel), plus the
  # usual wheel locations relative to the installed te_ops package (site-packages/nvidia/...).
  set(_te_rpath "")
  if(_te_cublaslt_libdir)
    list(APPEND _te_rpath "${_te_cublaslt_libdir}")
  endif()
  list(APPEND _te_rpath "$ORIGIN/../nvidia/cublas/lib" "$ORIGIN/../nvidia/cu13/lib" "$ORIGIN/../nvidia/cu12/lib")
  set_target_properties(_native_cublaslt PROPERTIES INSTALL_RPATH "${_te_rpath}" BUILD_RPATH "${_te_rpath}")
  message(STATUS "te_ops: dense native: cublasLt.h in ${TE_CUBLASLT_INCLUDE_DIR}, library ${_te_cublaslt_lib}")
else()
  message(STATUS "te_ops: dense native skipped: cublasLt.h not found (searched ${_te_inc_hints}; "
                 "set -DTE_CUBLAS_ROOT=<dir with include/cublasLt.h and lib/> or pip install nvidia-cublas)")
endif()
