# Included into llama.cpp's top-level project by deploy/local/llama.sh
# (CMAKE_PROJECT_INCLUDE) to cut the cold build of llama-server on a
# 2-core machine from 7-23 minutes to 4-7.5, without touching the
# numerics:
#
#  - unity builds (several sources compiled as one translation unit) for
#    the libraries whose time goes into parsing the same heavy headers
#    again and again: libllama, the common library (minus json.cpp, whose
#    template specializations must come first) and the server's two
#    libraries. ggml and mtmd stay one unit per source (their sources
#    clash when merged).
#  - -O1 for the HTTP, JSON, argument and multimodal code of the server,
#    which is not on the token path; ggml (every kernel) and libllama keep
#    the release -O3.
#
# Neither changes a floating-point operation (no -ffast-math anywhere):
# the same request with the same seed returns byte-identical tokens and
# log-probs from this build and from a plain release build (checked with
# SmolLM2-135M-Instruct, 48 tokens, n_probs 3).
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL _trajflow_fast_build)
function(_trajflow_fast_build)
  foreach(t llama llama-common server-context llama-server-impl)
    if(TARGET ${t})
      set_property(TARGET ${t} PROPERTY UNITY_BUILD ON)
      set_property(TARGET ${t} PROPERTY UNITY_BUILD_BATCH_SIZE 12)
    endif()
  endforeach()
  if(TARGET llama-common)
    get_target_property(_src llama-common SOURCE_DIR)
    set_source_files_properties(${_src}/json.cpp TARGET_DIRECTORY llama-common PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
  foreach(t llama-common mtmd server-context llama-server-impl cpp-httplib llama-server)
    if(TARGET ${t})
      set_property(TARGET ${t} APPEND PROPERTY COMPILE_OPTIONS -O1)
    endif()
  endforeach()
endfunction()
