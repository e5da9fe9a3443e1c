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

#[test]
#[ignore = "needs a Hopper GPU (cargo xtask test --gpu, bundle/run-tests.sh)"]
fn devices_of_one_context_share_the_module() {
    let Some(dev) = device_or_skip("devices_of_one_context_share_the_module") else {
        return;
    };
    // The context a server already holds (candle's CudaDevice retains the primary context the
    // same way): a Device made from it reuses the loaded module, and so does Device::new.
    let ctx = mkernel::cudarc::driver::CudaContext::new(dev.ordinal()).unwrap();
    let from_ctx = Device::from_context(ctx.clone()).unwrap();
    assert!(
        from_ctx.shares_module_with(&dev),
        "from_context loaded the module again"
    );
    assert!(Device::new(dev.ordinal()).unwrap().shares_module_with(&dev));
    // The device works on the caller's own stream and buffers.
    let stream = ctx.new_stream().unwrap();
    let mut out = stream.alloc_zeros::<u32>(257).unwrap();
    from_ctx.iota(&stream, &mut out, 3).unwrap();
    let host = stream.clone_dtoh(&out).unwrap();
    assert!(host.iter().enumerate().all(|(i, &v)| v == i as u32 + 3));
}
