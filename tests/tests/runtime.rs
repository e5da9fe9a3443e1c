//! The runtime end to end: PTX loads, a kernel launches, no-driver is an error.
use mkernel::runtime::driver_present;
use mkernel::{Device, Error};
use mkernel_tests::gpu::device_or_skip;

#[test]
fn no_driver_is_an_error_not_a_panic() {
    if driver_present() {
        eprintln!("SKIPPED: a CUDA driver is present, so the no-driver path cannot be shown here");
        return;
    }
    let e = Device::new(0).err().expect("Device::new must fail without a driver");
    assert!(matches!(e, Error::NoDriver));
    assert!(e.to_string().contains("no CUDA driver found"), "{e}");
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn iota_kernel_runs() {
    let Some(dev) = device_or_skip("iota_kernel_runs") else {
        return;
    };
    let stream = dev.default_stream();
    let mut out = stream.alloc_zeros::<u32>(1000).unwrap();
    dev.iota(&stream, &mut out, 7).unwrap();
    let host = stream.clone_dtoh(&out).unwrap();
    assert!(host.iter().enumerate().all(|(i, &v)| v == i as u32 + 7));
    println!("device {} with {} SMs ran mk_iota_u32", dev.ordinal(), dev.sm_count());
}

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn missing_device_is_reported() {
    let Some(_dev) = device_or_skip("missing_device_is_reported") else {
        return;
    };
    let e = Device::new(1000).err().expect("device 1000 does not exist");
    assert!(matches!(e, Error::NoDevice { ordinal: 1000, .. }), "{e}");
}
