"""The release of tierd this package is: the one place its version is written. CMakeLists.txt reads
it for the daemon, the client library and the .deb; pyproject.toml for the wheel."""
__version__ = "0.1.0"
