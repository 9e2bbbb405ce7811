# cmake --install: headers, static libraries and a CMake package, so a LibTorch trainer can
#   find_package(patrickstar CONFIG REQUIRED)   target_link_libraries(app PRIVATE patrickstar::patrickstar)
# (and patrickstar::models for the model zoo). Test-only headers (each folder's testing/) stay out.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_property(_ps_targets GLOBAL PROPERTY PS_EXPORTED_TARGETS)
install(TARGETS ${_ps_targets} EXPORT patrickstarTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(folder patrickstar chunk comm memtracer optimizer engine models)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${folder}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
install(EXPORT patrickstarTargets NAMESPACE patrickstar::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/patrickstar)
configure_package_config_file(cmake/patrickstarConfig.cmake.in
  ${PROJECT_BINARY_DIR}/patrickstarConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/patrickstar)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/patrickstarConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/patrickstarConfig.cmake ${PROJECT_BINARY_DIR}/patrickstarConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/patrickstar)
