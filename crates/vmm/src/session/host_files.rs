//! The host's files answered right after the exit that notified their
//! device: by the host's files in a plain run, by them and logged when
//! recording (a read by the stored file it read from), from the log when
//! replaying, which never touches the host's files.

use devices::host_files::Answer;
use journal::{output_digest, Recorder, Replayer};

use crate::vm::{HostFilesDevice, Machine, VmError};

/// A plain run: the server answers.
pub(super) fn serve_live(m: &mut Machine) {
    let vm = &mut m.vm;
    let Some(HostFilesDevice {
        device,
        server: Some(server),
    }) = &mut vm.host_files
    else {
        return;
    };
    for request in device.take_requests(&vm.mem) {
        let reply = request
            .message
            .as_deref()
            .map(|msg| server.answer(msg, request.room).bytes());
        device.complete(request, reply.as_deref(), &vm.mem);
    }
}

/// Recording: the server answers and each reply is logged.
pub(super) fn serve_recorded(m: &mut Machine, recorder: &mut Recorder) -> Result<(), VmError> {
    let vm = &mut m.vm;
    let Some(HostFilesDevice {
        device,
        server: Some(server),
    }) = &mut vm.host_files
    else {
        return Ok(());
    };
    for request in device.take_requests(&vm.mem) {
        let Some(message) = request.message.as_deref() else {
            device.complete(request, None, &vm.mem);
            continue;
        };
        let digest = output_digest(message);
        let answer = server.answer(message, request.room);
        match &answer {
            Answer::Message(reply) => recorder.host_files(digest, reply)?,
            Answer::Read {
                content,
                offset,
                count,
                ..
            } => {
                recorder.host_file_read(digest, &content.digest, &content.bytes, *offset, *count)?
            }
        }
        let reply = answer.bytes();
        device.complete(request, Some(&reply), &vm.mem);
    }
    Ok(())
}

/// Replay: the recording's replies, from the log and the trace's files.
pub(super) fn serve_replayed(m: &mut Machine, log: &mut Replayer) -> Result<(), VmError> {
    let vm = &mut m.vm;
    let Some(HostFilesDevice { device, .. }) = &mut vm.host_files else {
        return Ok(());
    };
    for request in device.take_requests(&vm.mem) {
        let reply = match request.message.as_deref() {
            Some(message) => Some(log.host_files(message)?),
            None => None,
        };
        device.complete(request, reply.as_deref(), &vm.mem);
    }
    Ok(())
}
