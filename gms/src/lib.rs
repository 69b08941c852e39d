//! GPU Memory Service (GMS): owns weights outside any engine process.
