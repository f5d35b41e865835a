# Run by `cmake --install` (and CPack): the files whose contents or place depend on the prefix
# chosen at install time. The configuration lives in /etc for the /usr prefix (the package), in
# PREFIX/etc otherwise; the unit names the installed binary and that configuration.
set(prefix "${CMAKE_INSTALL_PREFIX}")
if(prefix STREQUAL "/usr")
  set(sysconfdir /etc)
else()
  set(sysconfdir "${prefix}/etc")
endif()
set(TIERD_BINARY "${prefix}/bin/tierd")
set(TIERD_CONFIG_FILE "${sysconfdir}/tierd/tierd.toml")
set(TIERD_DOC_DIR "${prefix}/share/doc/tierd")
configure_file("${TIERD_SOURCE_DIR}/deploy/systemd/tierd.service.in"
  "${TIERD_BINARY_DIR}/install/tierd.service" @ONLY)
file(INSTALL "${TIERD_BINARY_DIR}/install/tierd.service"
  DESTINATION "${prefix}/lib/systemd/system")
file(INSTALL "${TIERD_SOURCE_DIR}/deploy/systemd/tierd.sysusers"
  DESTINATION "${prefix}/lib/sysusers.d" RENAME tierd.conf)
file(INSTALL "${TIERD_SOURCE_DIR}/deploy/tierd.toml" DESTINATION "${sysconfdir}/tierd")
