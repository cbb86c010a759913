//! Named tensors to and from one safetensors file: the storage format of optimizer state (and
//! anything else that is just a list of tensors).

use std::path::Path;

use tch::{Device, Tensor};

use crate::error::{Error, Result};

/// Writes `tensors` (any device or dtype) to a safetensors file at `path`, copied to CPU.
pub fn save_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let cpu: Vec<(String, Tensor)> =
        tensors.iter().map(|(n, t)| (n.clone(), t.detach().to(Device::Cpu).contiguous())).collect();
    Tensor::write_safetensors(&cpu, path).map_err(Error::torch(format!("write {}", path.display())))
}

/// Reads every tensor of the safetensors file at `path` onto `device`, sorted by name.
pub fn load_tensors(path: &Path, device: Device) -> Result<Vec<(String, Tensor)>> {
    let mut tensors = Tensor::read_safetensors(path).map_err(Error::torch(format!("read {}", path.display())))?;
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tensors.into_iter().map(|(n, t)| (n, t.to(device))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_round_trip_with_names_dtypes_and_values() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.safetensors");
        let a = Tensor::from_slice(&[1.5f32, -2.0, 3.25]).reshape([3, 1]);
        let b = Tensor::from_slice(&[7i64, 8]);
        save_tensors(&path, &[("exp_avg.x".into(), a.shallow_clone()), ("step".into(), b.shallow_clone())]).unwrap();
        let back = load_tensors(&path, Device::Cpu).unwrap();
        assert_eq!(back.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["exp_avg.x", "step"]);
        assert!(back[0].1.equal(&a));
        assert!(back[1].1.equal(&b));
    }
}
