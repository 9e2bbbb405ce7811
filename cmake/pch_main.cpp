int main() { return 0; }  // Anchor for the executables' precompiled header.
