// Anchor for the shared precompiled header (cmake/Warnings.cmake).
