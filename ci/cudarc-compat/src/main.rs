//! Compiles only if cuarena builds against the user's choice of CUDA version (12.8 here), and
//! that choice is the one cudarc took. Run, it uses cuarena once, on the GPU if there is one.

use cuarena::{Allocator, Config, Error};

const _: () = assert!(cudarc::driver::sys::CUDA_VERSION == 12080, "the user's cuda-12080 must win");

fn main() -> Result<(), Error> {
    println!("cudarc bindings: CUDA {}", cudarc::driver::sys::CUDA_VERSION);
    match Allocator::cuda(0, Config::default()) {
        Ok(a) => {
            let p = a.allocate_per_thread(4096)?;
            a.deallocate_per_thread(p, 4096)?;
            println!("cuarena on GPU 0: ok");
        }
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => {
            println!("no GPU ({e}); compiled is what counts")
        }
        Err(e) => return Err(e),
    }
    Ok(())
}
