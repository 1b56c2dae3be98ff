//! Kernels for tests, benchmarks and the demo, loaded from PTX text with `cuModuleLoadData`
//! (no CUDA toolkit needed; the driver compiles the PTX). Source: `kernels/kernels.cu`.

use std::ffi::{CString, c_void};
use std::sync::Arc;

use cudarc::driver::sys;

use cuarena::device::cuda::{CudaDevice, check};
use cuarena::{Result, Stream};

const PTX: &str = include_str!("kernels/kernels.ptx");

/// The loaded kernels and a device counter of tag mismatches.
pub struct CudaKernels {
    dev: Arc<CudaDevice>,
    module: usize,
    tag_hold_check: usize,
    spin: usize,
    errors: u64,
    live: u64,
}

// SAFETY: module and function handles may be used from any thread with the context current.
unsafe impl Send for CudaKernels {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for CudaKernels {}

impl CudaKernels {
    /// Loads the kernels on `dev`.
    pub fn load(dev: Arc<CudaDevice>) -> Result<CudaKernels> {
        let _g = dev.enter()?;
        let ptx = CString::new(PTX).expect("PTX has no NUL");
        let mut module = std::ptr::null_mut();
        // SAFETY: `ptx` is NUL-terminated PTX text; the context is current.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, ptx.as_ptr() as *const c_void)
        })?;
        let func = |name: &str| -> Result<usize> {
            let n = CString::new(name).expect("no NUL");
            let mut f = std::ptr::null_mut();
            // SAFETY: the module is loaded; `n` is NUL-terminated.
            check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut f, module, n.as_ptr()) })?;
            Ok(f as usize)
        };
        let (tag_hold_check, spin) = (func("tag_hold_check")?, func("spin")?);
        let mut counters = 0;
        // SAFETY: out-pointer valid; 16 bytes: the error counter and two spin counters.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut counters, 16) })?;
        // SAFETY: the allocation is 16 bytes = 4 words.
        check("cuMemsetD32", unsafe { sys::cuMemsetD32_v2(counters, 0, 4) })?;
        Ok(CudaKernels {
            dev,
            module: module as usize,
            tag_hold_check,
            spin,
            errors: counters,
            live: counters + 8,
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    fn launch(
        &self,
        f: usize,
        grid: u32,
        block: u32,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let _g = self.dev.enter()?;
        // SAFETY: `f` is a kernel of our module whose parameters match `params` (each entry
        // points at a live value of the right type); the stream is the caller's.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f as sys::CUfunction,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream.as_raw() as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Writes `tag` over `[ptr, ptr+len)`, spins `hold_ns`, and counts words that changed.
    pub fn tag_hold_check(&self, ptr: u64, len: usize, tag: u32, hold_ns: u64, stream: Stream) -> Result<()> {
        let (mut p, mut n, mut t, mut h, mut e) = (ptr, (len / 4) as u64, tag, hold_ns, self.errors);
        let grid = (n.div_ceil(256).clamp(1, 64)) as u32;
        let mut params = [
            &mut p as *mut u64 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
            &mut t as *mut u32 as *mut c_void,
            &mut h as *mut u64 as *mut c_void,
            &mut e as *mut u64 as *mut c_void,
        ];
        self.launch(self.tag_hold_check, grid, 256, stream, &mut params)
    }

    /// A one-thread kernel that spins `ns`; tracks how many spin kernels overlap.
    pub fn spin(&self, ns: u64, stream: Stream) -> Result<()> {
        let (mut t, mut live, mut max) = (ns, self.live, self.live + 4);
        let mut params = [
            &mut t as *mut u64 as *mut c_void,
            &mut live as *mut u64 as *mut c_void,
            &mut max as *mut u64 as *mut c_void,
        ];
        self.launch(self.spin, 1, 32, stream, &mut params)
    }

    /// Waits for all work, then reads `(tag mismatches, most spin kernels seen at once)` and
    /// resets both.
    pub fn take_counters(&self) -> Result<(u64, u32)> {
        let _g = self.dev.enter()?;
        // SAFETY: context current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        let mut host = [0u32; 4];
        // SAFETY: `host` has room for the 16 bytes copied.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut c_void, self.errors, 16)
        })?;
        // SAFETY: the allocation is 4 words.
        check("cuMemsetD32", unsafe { sys::cuMemsetD32_v2(self.errors, 0, 4) })?;
        Ok((host[0] as u64 | (host[1] as u64) << 32, host[3]))
    }

    /// Creates a non-blocking stream.
    pub fn create_stream(&self) -> Result<Stream> {
        let _g = self.dev.enter()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer valid; flag 1 = CU_STREAM_NON_BLOCKING.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, 1) })?;
        Ok(Stream::from_raw(s as usize))
    }

    /// Destroys a stream from [`CudaKernels::create_stream`].
    pub fn destroy_stream(&self, s: Stream) -> Result<()> {
        let _g = self.dev.enter()?;
        // SAFETY: the stream came from create_stream and is destroyed once.
        check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(s.as_raw() as sys::CUstream) })
    }

    /// Waits for all work on the device.
    pub fn synchronize(&self) -> Result<()> {
        let _g = self.dev.enter()?;
        // SAFETY: context current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

impl Drop for CudaKernels {
    fn drop(&mut self) {
        if cuarena::shutdown::process_exiting() {
            return;
        }
        if let Ok(_g) = self.dev.enter() {
            // SAFETY: allocated in `load`; the module is unloaded once.
            unsafe {
                sys::cuCtxSynchronize();
                sys::cuMemFree_v2(self.errors);
                sys::cuModuleUnload(self.module as sys::CUmodule);
            }
        }
    }
}
