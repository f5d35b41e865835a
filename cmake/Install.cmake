# What `cmake --install` puts where, and the .deb CPack builds from it (`cpack -G DEB` in the
# build directory). Prefix /usr/local by default; the package installs under /usr.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS tierd tierd-bench tierctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS tierd_client EXPORT tierdTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
set_target_properties(tierd_client PROPERTIES EXPORT_NAME client)
install(DIRECTORY client/include/tierd DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# find_package(tierd) and pkg-config.
set(tierd_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/tierd)
install(EXPORT tierdTargets NAMESPACE tierd:: DESTINATION ${tierd_cmake_dir})
configure_package_config_file(cmake/tierdConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/tierdConfig.cmake INSTALL_DESTINATION ${tierd_cmake_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/tierdConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tierdConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/tierdConfigVersion.cmake DESTINATION ${tierd_cmake_dir})
configure_file(cmake/tierd.pc.in ${CMAKE_CURRENT_BINARY_DIR}/tierd.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tierd.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The service: the unit, its user (sysusers.d) and the configuration, placed for the prefix given
# at install time.
install(CODE "set(TIERD_SOURCE_DIR \"${PROJECT_SOURCE_DIR}\")
  set(TIERD_BINARY_DIR \"${PROJECT_BINARY_DIR}\")")
install(SCRIPT cmake/InstallService.cmake)

# The Python package (pure Python over the C ABI, which it loads from the library directory).
# Relative to the prefix: under /usr (the .deb), where Debian's python3 finds packages of the
# system; under another prefix, put <prefix>/lib/python3/dist-packages on PYTHONPATH.
set(TIERD_PYTHON_DIR lib/python3/dist-packages CACHE STRING
  "Where the tierd Python package is installed, relative to the prefix")
install(DIRECTORY python/tierd DESTINATION ${TIERD_PYTHON_DIR}
  FILES_MATCHING PATTERN "*.py" PATTERN __pycache__ EXCLUDE)
install(FILES examples/train_gpt.py DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples)

# For the monitoring host: dashboards, scrape config and alert rules.
install(DIRECTORY dashboards/ DESTINATION ${CMAKE_INSTALL_DATADIR}/tierd/dashboards
  FILES_MATCHING PATTERN "*.json" PATTERN "README.md")
install(FILES deploy/prometheus/prometheus.yml deploy/prometheus/tierd-rules.yml
  DESTINATION ${CMAKE_INSTALL_DATADIR}/tierd/prometheus)
# For clusters: the Slurm recipe (docs/multinode.md).
install(PROGRAMS deploy/slurm/train.sbatch deploy/slurm/torchrun-node.sh
  DESTINATION ${CMAKE_INSTALL_DATADIR}/tierd/slurm)
install(FILES README.md docs/operations.md docs/configuration.md docs/multinode.md
  DESTINATION ${CMAKE_INSTALL_DOCDIR})

# The .deb.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME tierd)
set(CPACK_PACKAGE_VENDOR "tierd")
set(CPACK_PACKAGE_CONTACT "tierd developers <tierd@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
  "Tiered GPU/host/NVMe memory daemon for training large models on one node")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
set(CPACK_STRIP_FILES ON)  # the .deb ships without debug info
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)  # Depends: from the binaries' shared libraries
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
  ${PROJECT_SOURCE_DIR}/deploy/debian/postinst ${PROJECT_SOURCE_DIR}/deploy/debian/prerm
  ${PROJECT_SOURCE_DIR}/deploy/debian/postrm ${PROJECT_SOURCE_DIR}/deploy/debian/conffiles)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
