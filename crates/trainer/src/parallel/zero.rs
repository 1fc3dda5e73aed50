//! ZeRO (`training.zero = 1 | 2 | 3`): in a data-parallel run, each rank keeps the AdamW moments
//! and the f32 master weights of its own share of the parameters only.
//!
//! At stages 1 and 2 every parameter has one owner. A rank updates the parameters it owns; the owners then hand
//! every rank the new compute form of their parameters (the bf16 or f16 copy of the weights that
//! run in the compute dtype, the f32 value of the others). A rank that does not own a weight with
//! a low-precision copy holds that copy only: its f32 master and moments live on the owner.
//!
//! - **Stage 1**: the gradients are averaged on every rank (an all-reduce, as without ZeRO); a
//!   rank then drops the gradients of the parameters it does not own.
//! - **Stage 2** (runs of one process per GPU): each gradient is averaged onto its owner alone
//!   (NCCL's reduce), and every other rank drops it as soon as it is sent; the global gradient
//!   norm (for clipping) is the square root of the ranks' summed sums of squares over their own
//!   gradients. The gradients move as much as in an all-reduce, and the hand-over of the
//!   compute weights is a broadcast from each owner: stage 2 costs about what plain data
//!   parallelism costs.
//!
//! - **Stage 3** (runs of one process per GPU; `super::fsdp`): the share is not whole
//!   parameters but each rank's rows of every parameter, and the weights themselves are sharded
//!   too: a block's are gathered just before it runs, its gradients reduce-scattered onto the
//!   shards during the backward. Each rank updates its shards; there is no hand-over, and the
//!   global gradient norm is taken as under stage 2.
//!
//! How the hand-over travels: between processes, NCCL's broadcast from the owner. Between the
//! threads of one process, Burn's collectives offer all-reduce alone, so it is an all-reduce sum
//! in which every rank but the owner contributes zeros (exact: `x + 0 = x`), which moves each
//! value twice over the links; stage 2 is refused there.
//!
//! Checkpoints. Threads: every rank reads its share back ([`Shard::share`]) and rank 0 assembles
//! the whole masters and moments ([`Shard::whole`]) for one file. Processes: every rank writes its
//! share from its own GPU as a shard of a sharded checkpoint (`crate::checkpoint::shards`), so no
//! rank ever holds the whole state. Evaluation needs nothing more: it runs on the compute weights,
//! which every rank holds.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_backend::DeviceId;
use kernels::collective::ProcessGroup;

use super::collective::{reduce, Collective, Peers, ReduceOperation};
use super::fsdp::{GatherBlocks, GatherBlocksPlain, RowGather, RowShards};
use crate::host_copy;
use crate::optim::{to_prim, to_tensor, with_grad, AdamW, Moments};

/// Assigns each parameter, given by its number of elements, to one of `ranks` ranks: the largest
/// first, each to the rank holding the fewest elements so far (the lowest rank on a tie). The
/// result is the owner of each parameter, in the order given; it depends only on the sizes, so
/// every rank computes the same.
pub fn partition(sizes: &[usize], ranks: usize) -> Vec<usize> {
    assert!(ranks > 0, "at least one rank");
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; ranks];
    let mut owner = vec![0usize; sizes.len()];
    for i in order {
        let r = (0..ranks)
            .min_by_key(|&r| (load[r], r))
            .expect("at least one rank");
        owner[i] = r;
        load[r] += sizes[i];
    }
    owner
}

/// The parameters of `module` in its visiting order: id and number of elements.
pub fn parameters<B: Backend, M: burn::module::Module<B>>(module: &M) -> Vec<(ParamId, usize)> {
    struct List(Vec<(ParamId, usize)>);
    impl<B: Backend> ModuleVisitor<B> for List {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push((param.id, param.shape().num_elements()));
        }
    }
    let mut l = List(Vec::new());
    module.visit(&mut l);
    l.0
}

/// The ranks of a ZeRO run, as the hand-over reaches them.
#[derive(Clone)]
pub enum Members {
    /// Threads of this process: every rank's device id, as Burn's collectives name them.
    Threads(Vec<DeviceId>),
    /// Processes of their own, in an NCCL communicator.
    Processes(ProcessGroup),
}

impl Members {
    fn world(&self) -> usize {
        match self {
            Members::Threads(ids) => ids.len(),
            Members::Processes(g) => g.world(),
        }
    }
}

/// One rank's share of a ZeRO run.
#[derive(Clone)]
pub struct Shard {
    pub rank: usize,
    /// 1 or 2 (see the module's description).
    pub stage: u8,
    members: Members,
    owner: HashMap<ParamId, usize>,
    /// The compute dtype and the weights that run in it through a copy (none when it is f32).
    copy: Option<(FloatDType, HashSet<ParamId>)>,
    /// Stage 3: the rows of every parameter this rank keeps.
    rows: Option<Arc<RowShards>>,
}

/// One parameter of a rank's share, on the host: its f32 master, and its moments once it has them.
pub struct Owned {
    pub id: ParamId,
    pub value: TensorData,
    pub moments: Option<(TensorData, TensorData)>,
}

/// Elements held per rank: what each owns, and the whole model.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    pub owned: Vec<usize>,
    pub total: usize,
}

impl Shard {
    /// Rank `rank`'s share of `params` (see [`parameters`]) over `members`, at ZeRO stage
    /// `stage`; `copy`: the compute dtype and the weights that run in it through a copy (none in
    /// f32).
    ///
    /// # Panics
    /// At stage 2 between threads (Burn's collectives have no reduce to one rank).
    pub fn new(
        params: &[(ParamId, usize)],
        rank: usize,
        members: Members,
        copy: Option<(FloatDType, HashSet<ParamId>)>,
        stage: u8,
    ) -> Self {
        assert!(
            stage == 1 || matches!(members, Members::Processes(_)),
            "ZeRO-{stage} needs a run of processes"
        );
        assert!(stage < 3, "ZeRO-3 shards rows: Shard::rows");
        let sizes: Vec<usize> = params.iter().map(|p| p.1).collect();
        let owners = partition(&sizes, members.world());
        Self {
            rank,
            stage,
            members,
            owner: params.iter().map(|p| p.0).zip(owners).collect(),
            copy,
            rows: None,
        }
    }

    /// Rank `group.rank()`'s share under ZeRO-3: its rows of every parameter, as `rows` splits
    /// them (made for this rank and world).
    pub fn rows(rows: Arc<RowShards>, group: ProcessGroup) -> Self {
        let rank = group.rank();
        assert_eq!(
            (rows.rank, rows.world),
            (rank, group.world()),
            "the row split is made for this rank"
        );
        Self {
            rank,
            stage: 3,
            members: Members::Processes(group),
            owner: rows.ids().map(|id| (*id, rank)).collect(),
            copy: None,
            rows: Some(rows),
        }
    }

    /// Stage 3: how the rows are split.
    pub fn row_shards(&self) -> Option<&Arc<RowShards>> {
        self.rows.as_ref()
    }

    /// Stage 3: the training forward's hook that gathers each block just before it runs.
    pub fn gathers<AB>(&self) -> Option<GatherBlocks<AB>>
    where
        AB: RowGather,
        AB::InnerBackend: Collective,
    {
        let (rows, Members::Processes(group)) = (self.rows.as_ref()?, &self.members) else {
            return None;
        };
        Some(GatherBlocks::new(rows.clone(), Arc::new(group.clone())))
    }

    /// Stage 3: [`Shard::gathers`] without autodiff (evaluation).
    pub fn plain_gathers<B: Collective + kernels::Backend>(&self) -> Option<GatherBlocksPlain<B>> {
        let (rows, Members::Processes(group)) = (self.rows.as_ref()?, &self.members) else {
            return None;
        };
        Some(GatherBlocksPlain {
            shards: rows.clone(),
            exchange: Arc::new(group.clone()),
        })
    }

    /// How many ranks share the state.
    pub fn world(&self) -> usize {
        self.members.world()
    }

    /// The elements each rank owns, for the log.
    pub fn split(&self, params: &[(ParamId, usize)]) -> Split {
        if let Some(rows) = &self.rows {
            let per_rank = params.iter().map(|(id, _)| rows.shard_elements(id)).sum();
            return Split {
                owned: vec![per_rank; self.world()],
                total: params.iter().map(|(id, _)| rows.elements(id)).sum(),
            };
        }
        let mut owned = vec![0; self.world()];
        for (id, n) in params {
            owned[self.owner[id]] += n;
        }
        Split {
            owned,
            total: params.iter().map(|p| p.1).sum(),
        }
    }

    /// Whether this rank owns the parameter.
    pub fn owns(&self, id: &ParamId) -> bool {
        self.owner.get(id) == Some(&self.rank)
    }

    /// The parameters this rank updates.
    pub fn owned(&self) -> HashSet<ParamId> {
        self.owner
            .iter()
            .filter(|(_, r)| **r == self.rank)
            .map(|(id, _)| *id)
            .collect()
    }

    /// The dtype a parameter runs in: the compute dtype for a weight with a copy, f32 otherwise.
    fn compute_dtype(&self, id: &ParamId) -> Option<FloatDType> {
        self.copy
            .as_ref()
            .and_then(|(dt, ids)| ids.contains(id).then_some(*dt))
    }

    /// Turns a whole replica (rank 0's state, as a fresh or resumed run starts) into this rank's
    /// share: the optimizer keeps the moments of the owned parameters only and updates only those;
    /// a weight with a copy that another rank owns keeps only its copy, as the parameter's value.
    /// Under ZeRO-3 the model comes already cut to this rank's rows, and only the optimizer is
    /// readied.
    pub fn take_share<AB, M>(&self, model: M, opt: &mut AdamW<AB::InnerBackend>) -> M
    where
        AB: AutodiffBackend,
        M: AutodiffModule<AB>,
    {
        if let Some(rows) = &self.rows {
            // The run cut the model to its rows as soon as it was built (`RowShards::shard`).
            rows.keep_shards(opt);
            return model;
        }
        opt.moments.retain(|id, _| self.owns(id));
        opt.copies.retain(|id, _| self.owns(id));
        opt.owned = Some(self.owned());
        struct Share<'a, B: Backend> {
            shard: &'a Shard,
            copies: &'a mut HashMap<ParamId, FloatTensor<B>>,
        }
        impl<AB: AutodiffBackend> ModuleMapper<AB> for Share<'_, AB::InnerBackend> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<AB, D>>,
            ) -> Param<Tensor<AB, D>> {
                let (id, tensor, mapper) = param.consume();
                let dt = self.shard.compute_dtype(&id);
                let tensor = match dt {
                    Some(dt) if !self.shard.owns(&id) => {
                        let grad = tensor.is_require_grad();
                        let c = tensor.inner().cast(dt);
                        self.copies.insert(id, to_prim(c.clone()));
                        with_grad(Tensor::from_inner(c), grad)
                    }
                    _ => tensor,
                };
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
        model.map(&mut Share {
            shard: self,
            copies: &mut opt.copies,
        })
    }

    /// After an update of the owned parameters: every rank receives every parameter's compute
    /// form from its owner. The owner of a weight with a copy keeps its master and takes the copy
    /// as received; every other parameter's value becomes the received one. Collectives in the
    /// module's order, the same on every rank; then the device waits for them.
    pub fn publish<AB, M>(&self, model: M, opt: &mut AdamW<AB::InnerBackend>) -> M
    where
        AB: AutodiffBackend,
        AB::InnerBackend: Collective,
        M: AutodiffModule<AB>,
    {
        if self.rows.is_some() {
            // Every rank updated its own rows; nobody else holds them.
            return model;
        }
        struct Publish<'a, B: Backend> {
            shard: &'a Shard,
            copies: &'a mut HashMap<ParamId, FloatTensor<B>>,
            device: Option<B::Device>,
        }
        impl<AB: AutodiffBackend> ModuleMapper<AB> for Publish<'_, AB::InnerBackend>
        where
            AB::InnerBackend: Collective,
        {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<AB, D>>,
            ) -> Param<Tensor<AB, D>> {
                let (id, tensor, mapper) = param.consume();
                let grad = tensor.is_require_grad();
                let x = tensor.inner();
                self.device.get_or_insert_with(|| x.device());
                let owns = self.shard.owns(&id);
                let dt = self.shard.compute_dtype(&id);
                let mine = match (owns, dt) {
                    // The copy the fused step wrote, else the cast of the new master.
                    (true, Some(dt)) => match self.copies.remove(&id) {
                        Some(c) => to_tensor::<_, D>(&c),
                        None => x.clone().cast(dt),
                    },
                    (true, None) => x.clone(),
                    // The parameter's value on a non-owner is already in the compute form's
                    // dtype (the copy, or f32).
                    (false, _) => match &self.shard.members {
                        Members::Threads(_) => x.zeros_like(),
                        Members::Processes(_) => Tensor::empty(x.shape(), (&x.device(), x.dtype())),
                    },
                };
                let got = match &self.shard.members {
                    Members::Threads(ids) => {
                        reduce(mine, ReduceOperation::Sum, Peers::Threads(ids))
                    }
                    Members::Processes(g) => g.broadcast(mine, self.shard.owner[&id]),
                };
                let value = match (owns, dt) {
                    (true, Some(_)) => {
                        self.copies.insert(id, to_prim(got));
                        x
                    }
                    (false, Some(_)) => {
                        self.copies.insert(id, to_prim(got.clone()));
                        got
                    }
                    (_, None) => got,
                };
                Param::from_mapped_value(id, with_grad(Tensor::from_inner(value), grad), mapper)
            }
        }
        let mut p = Publish {
            shard: self,
            copies: &mut opt.copies,
            device: None,
        };
        let model = model.map(&mut p);
        // Between processes the broadcasts run on CubeCL's stream, in its order.
        if let (Some(d), Members::Threads(_)) = (p.device, &self.members) {
            <AB::InnerBackend as Collective>::sync(&d);
        }
        model
    }

    /// ZeRO-2: averages each gradient onto its owner (NCCL's reduce, in the module's order, the
    /// same on every rank); a rank keeps the gradients of the parameters it owns and drops the
    /// others once sent.
    pub fn reduce_grads<AB, M>(&self, module: &M, grads: &mut GradientsParams)
    where
        AB: AutodiffBackend,
        AB::InnerBackend: Collective,
        M: AutodiffModule<AB>,
    {
        let Members::Processes(group) = &self.members else {
            unreachable!("ZeRO-2 runs between processes only")
        };
        struct ToOwner<'a> {
            shard: &'a Shard,
            group: &'a ProcessGroup,
            grads: &'a mut GradientsParams,
        }
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for ToOwner<'_>
        where
            AB::InnerBackend: Collective,
        {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                let Some(g) = self.grads.remove::<AB::InnerBackend, D>(param.id) else {
                    return;
                };
                let owner = self.shard.owner[&param.id];
                let mean = self
                    .group
                    .reduce(g, kernels::collective::ReduceOp::Mean, owner);
                if owner == self.shard.rank {
                    self.grads.register::<AB::InnerBackend, D>(param.id, mean);
                }
            }
        }
        module.visit(&mut ToOwner {
            shard: self,
            group,
            grads,
        });
    }

    /// This rank's share of the state, read back to the host: the f32 master of every parameter it
    /// owns, with its moments once it has them (for [`Shard::whole`] on rank 0).
    pub fn share<AB, M>(&self, model: &M, opt: &AdamW<AB::InnerBackend>) -> Vec<Owned>
    where
        AB: AutodiffBackend,
        M: AutodiffModule<AB>,
    {
        struct Share<'a, B: Backend> {
            shard: &'a Shard,
            opt: &'a AdamW<B>,
            out: Vec<Owned>,
        }
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for Share<'_, AB::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                if !self.shard.owns(&param.id) {
                    return;
                }
                let moments = self.opt.moments.get(&param.id).map(|s| {
                    (
                        host_copy::read_f32_data(to_tensor::<AB::InnerBackend, D>(&s.m)),
                        host_copy::read_f32_data(to_tensor::<AB::InnerBackend, D>(&s.v)),
                    )
                });
                self.out.push(Owned {
                    id: param.id,
                    value: host_copy::read_f32_data(param.val().inner()),
                    moments,
                });
            }
        }
        let mut v = Share {
            shard: self,
            opt,
            out: Vec::new(),
        };
        model.visit(&mut v);
        v.out
    }

    /// On rank 0: the whole f32 model and optimizer state (for a checkpoint), from its own share
    /// and the other ranks' [`Shard::share`]s. The state moves through the host, as a checkpoint's
    /// does anyway, so nothing here waits on a collective.
    pub fn whole<AB, M>(
        &self,
        model: &M,
        opt: &AdamW<AB::InnerBackend>,
        shares: Vec<Owned>,
    ) -> (M, AdamW<AB::InnerBackend>)
    where
        AB: AutodiffBackend,
        M: AutodiffModule<AB>,
    {
        struct Whole<'a, B: Backend> {
            others: HashMap<ParamId, Owned>,
            moments: &'a mut HashMap<ParamId, Moments<B>>,
        }
        impl<AB: AutodiffBackend> ModuleMapper<AB> for Whole<'_, AB::InnerBackend> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<AB, D>>,
            ) -> Param<Tensor<AB, D>> {
                let (id, tensor, mapper) = param.consume();
                let Some(o) = self.others.remove(&id) else {
                    return Param::from_mapped_value(id, tensor, mapper);
                };
                let grad = tensor.is_require_grad();
                let device = tensor.inner().device();
                let up = |d: TensorData| {
                    Tensor::<AB::InnerBackend, D>::from_data(d, (&device, DType::F32))
                };
                if let Some((m, v)) = o.moments {
                    self.moments.insert(
                        id,
                        Moments {
                            m: to_prim(up(m)),
                            v: to_prim(up(v)),
                        },
                    );
                }
                let value = with_grad(Tensor::from_inner(up(o.value)), grad);
                Param::from_mapped_value(id, value, mapper)
            }
        }
        let mut whole_opt = opt.clone();
        whole_opt.owned = None;
        whole_opt.copies.clear();
        let whole_model = model.clone().map(&mut Whole {
            others: shares.into_iter().map(|o| (o.id, o)).collect(),
            moments: &mut whole_opt.moments,
        });
        (whole_model, whole_opt)
    }

    /// CRC-32 of the compute form of every parameter (a weight's copy, the others' f32 value), as
    /// every rank holds it after [`Shard::publish`]: equal on replicas that stayed identical.
    pub fn checksum<AB: AutodiffBackend, M: AutodiffModule<AB>>(
        &self,
        model: &M,
        opt: &AdamW<AB::InnerBackend>,
    ) -> u32 {
        struct Crc<'a, B: AutodiffBackend> {
            shard: &'a Shard,
            copies: &'a HashMap<ParamId, FloatTensor<B::InnerBackend>>,
            hasher: crc32fast::Hasher,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Crc<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let x = param.val().inner();
                let form = match (
                    self.shard.compute_dtype(&param.id),
                    self.copies.get(&param.id),
                ) {
                    (Some(_), Some(c)) => to_tensor::<_, D>(c),
                    (Some(dt), None) => x.cast(dt),
                    (None, _) => x,
                };
                host_copy::read_bytes(form, |b| self.hasher.update(b));
            }
        }
        let mut c = Crc::<AB> {
            shard: self,
            copies: &opt.copies,
            hasher: crc32fast::Hasher::new(),
        };
        model.visit(&mut c);
        c.hasher.finalize()
    }
}
