//! Compiles `proto/tally/v1/like_event.proto` with protox (a pure-Rust protobuf
//! compiler), so building tally never needs a `protoc` binary on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/tally/v1/like_event.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
